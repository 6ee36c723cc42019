"""The options a torch state dict cannot show, compared where the torch module itself is given.

:func:`ft.nn.load_torch_state_dict(model, module) <functree.interop._torch.load_torch_state_dict>`
reads the module's ``state_dict()`` and, for every ``ft.nn`` layer at a torch name of one of
the module's submodules, compares the constructor options that no tensor holds (a
``TransformerEncoderLayer``'s ``norm_first`` and activation, the heads of an attention, a
norm's ``eps``, a convolution's ``stride`` / ``padding`` / ``dilation`` / ``padding_mode``,
an RNN's ``nonlinearity`` and ``batch_first``, a pool's window (adaptive, LP and unpooling
too), a ``Dropout``'s ``p``, an ``Upsample``'s mode and size, a pad's widths and value, a pixel
or channel shuffle's factor, an activation module in a ``Sequential``): each differing one
would load silently into a model computing other numbers. :data:`OPTIONS_DIFFER` lists them all.

torch is never imported here: the module given is a torch module only where torch is
already imported (``sys.modules``), and its classes are told apart by name.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from functree import _activations as activations
from functree._activations import identity
from functree.nn._attention import MultiheadAttention
from functree.nn._conv import Conv, ConvTranspose, transpose_padding
from functree.nn._dropout import Dropout
from functree.nn._embedding import Embedding
from functree.nn._embedding_bag import EmbeddingBag
from functree.nn._fractional_pool import _FractionalMaxPool
from functree.nn._linear import Dense
from functree.nn._lp_pool import _LPPool
from functree.nn._normalization import (
    BatchNorm,
    GroupNorm,
    LayerNorm,
    LocalResponseNorm,
    RMSNorm,
    _InstanceNorm,
)
from functree.nn._padding import _ConstantPad, _Pad
from functree.nn._pooling import _AdaptiveMaxPool, _AdaptivePool, _AvgPool, _MaxPool, _MaxUnpool
from functree.nn._recurrent import RNN, SimpleRNNCell
from functree.nn._recurrent_layers import Bidirectional, StackedRNN
from functree.nn._resample import _Upsample
from functree.nn._rrelu import RReLU
from functree.nn._sequential import Lambda
from functree.nn._shuffle import ChannelShuffle, PixelShuffle, PixelUnshuffle
from functree.nn._transformer import TransformerDecoderLayer, TransformerEncoderLayer

__all__ = ["check_options", "torch_module"]

OPTIONS_DIFFER = """\
ft.nn.load_torch_state_dict: the torch module's options that no tensor holds differ from the \
model's; its tensors would load into a model computing other numbers, without an error \
(strict=False too: the report lists tensors, not options):
{lines}
Build each layer with the argument shown:
{fixes}
       or:  ft.nn.load_torch_state_dict(model, module.state_dict())   # the tensors alone, options unchecked"""

# OPTIONS_DIFFER's {lines}: one per option.
OPTION_LINE = "  {torch} ({torch_class}; ft: {ft}, {ft_class}): torch's {option}={torch_value}, the model's {ft_option}={ft_value}"
# ... where no ft.nn layer has the option (its {fix} line names what to do instead).
NO_COUNTERPART_LINE = "  {torch} ({torch_class}; ft: {ft}, {ft_class}): torch's {option}={torch_value}, which ft.nn has no option for"

# OPTIONS_DIFFER's {fixes}: one per layer (its key paths follow, "# at ...").
FIX_LINE = "    right:  {call}"
# ... for a function in a Sequential
FUNCTION_LINE = "    right:  ft.nn.Sequential(..., {function}, ...)"
# ... and one per torch option no ft.nn layer has.
NONE_LINE = "    none:   {none} ({option})"

# The {fix} of a torch option no ft.nn layer has.
NO_ZERO_ATTN = ("ft.nn's transformer layers build their attention without add_zero_attn: set it on the attention, "
                "layer.replace(self_attn=layer.self_attn.replace(add_zero_attn=True))")
NO_MAX_NORM = "renormalize the rows yourself, emb = emb.renormalized(tokens, max_norm), before each forward"


@dataclasses.dataclass(frozen=True)
class Differs:
    """One option of torch module ``torch`` (class ``torch_class``) against the ft layer at ``ft``."""

    option: str  # torch's name of it
    torch_value: Any
    ft_option: str  # the ft layer's field (or its constructor's argument)
    ft_value: Any
    fix: str | None  # the constructor argument giving torch's (None: no ft.nn option; ``none`` says what instead)
    none: str = ""


def torch_module(value: Any) -> Any:
    """``value`` if it is a torch ``nn.Module`` (torch already imported, never imported here), else None."""
    torch = sys.modules.get("torch")
    module_class = getattr(getattr(torch, "nn", None), "Module", None)
    return value if isinstance(module_class, type) and isinstance(value, module_class) else None


def _torch_class(module: Any) -> str:
    """The name of the first of torch's own classes ``module`` is (a user's subclass of
    ``nn.Linear``: ``Linear``); "" for a user's own module."""
    for cls in type(module).__mro__:
        if cls.__module__.startswith("torch.nn.modules"):
            return cls.__name__
    return ""


def check_options(module: Any, nodes: Mapping[str, tuple[str, Any]], to_model: Callable[[str], str],
                  ports: list[str]) -> None:
    """Raise :data:`OPTIONS_DIFFER` where a submodule of the torch ``module`` and the ft layer
    at its torch name (``nodes``: torch name → (key path, layer), after ``to_model``, the
    ``rename=``) differ in an option. Torch modules of no known class are walked through; a
    port's (``ports``: their torch names) are its converter's; a transformer layer's
    sublayers are its own (compared with its arguments)."""
    found: list[tuple[str, str, str, Any, list[Differs]]] = []
    covered: list[str] = []
    for name, sub in module.named_modules():
        torch = to_model(name) if name else ""
        if any(_inside(torch, p) for p in ports) or any(torch != c and _inside(torch, c) for c in covered):
            continue
        kind = _torch_class(sub)
        compare = _CHECKS.get(kind)
        if compare is None or torch not in nodes:
            continue
        ft, node = nodes[torch]
        differs = compare(sub, node, kind)
        if differs is not None and kind.startswith("Transformer") and kind.endswith("Layer"):
            covered.append(torch)  # its sublayers compared with its own arguments (a user's block: each of them)
        if differs:
            found.append((name, kind, ft, node, differs))
    if not found:
        return
    lines: list[str] = []
    fixes: dict[str, list[str]] = {}  # each fix line with the layers it is for (a Stack's members share one)
    for name, kind, ft, node, differs in found:
        shown = dict(torch=name or "(the module)", torch_class=kind, ft=ft or "(the model)", ft_class=type(node).__name__)
        for d in differs:
            line = OPTION_LINE if d.fix is not None else NO_COUNTERPART_LINE
            lines.append(line.format(option=d.option, torch_value=_show(d.torch_value), ft_option=d.ft_option,
                                     ft_value=_show(d.ft_value), **shown))
        arguments = list(dict.fromkeys(d.fix for d in differs if d.fix is not None))  # a decoder's two nhead=
        if arguments and isinstance(node, Lambda):  # a function of a Sequential: another function
            fixes.setdefault(FUNCTION_LINE.format(function=arguments[0]), []).append(shown["ft"])
        elif arguments:
            fixes.setdefault(FIX_LINE.format(call=f"{_constructor(node)}(..., {', '.join(arguments)})"), []).append(
                shown["ft"])
        for d in differs:
            if d.fix is None:
                fixes.setdefault(NONE_LINE.format(none=d.none, option=d.option), []).append(shown["ft"])
    shown_fixes = [f"{line}   # at {', '.join(at[:4])}{' ...' if len(at) > 4 else ''}" for line, at in fixes.items()]
    raise ValueError(OPTIONS_DIFFER.format(lines="\n".join(lines), fixes="\n".join(shown_fixes)))


def _inside(name: str, prefix: str) -> bool:
    return not prefix or name == prefix or name.startswith(prefix + ".")


def _show(value: Any) -> str:
    return getattr(value, "__name__", None) or repr(value)


def _constructor(node: Any) -> str:
    return f"ft.nn.{type(node).__name__}"


def _any(layer: Any) -> Any:
    """``layer``, no longer narrowed to the union of the classes one check allowed."""
    return layer


def _differ(torch_value: Any, ft_value: Any) -> bool:
    if isinstance(torch_value, float) or isinstance(ft_value, float):
        if torch_value is None or ft_value is None:
            return torch_value is not ft_value
        return abs(float(torch_value) - float(ft_value)) > 1e-12 * max(abs(float(torch_value)), 1.0)
    return torch_value != ft_value


def _options(pairs: list[tuple[str, Any, str, Any, str]]) -> list[Differs]:
    """``(torch option, its value, ft field, its value, fix)`` rows that differ."""
    return [Differs(o, t, f, v, fix) for o, t, f, v, fix in pairs if _differ(t, v)]


def _sizes(value: Any, rank: int) -> tuple[int, ...]:
    return tuple(int(v) for v in value) if isinstance(value, (tuple, list)) else (int(value),) * rank


def _same_pads(kernel: tuple[int, ...], dilation: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """``"SAME"`` at stride 1 as pairs (XLA's and torch's ``padding="same"``: the lower half low)."""
    return tuple((d * (k - 1) // 2, d * (k - 1) - d * (k - 1) // 2) for k, d in zip(kernel, dilation))


def _pairs(padding: Any, kernel: tuple[int, ...], strides: tuple[int, ...], dilation: tuple[int, ...]) -> Any:
    """A forward window's padding as ``(low, high)`` pairs; ``"SAME"`` off stride 1 as it is
    (it depends on the input's size)."""
    if padding == "VALID" or padding == "valid":
        return ((0, 0),) * len(kernel)
    if padding in ("SAME", "same"):
        return _same_pads(kernel, dilation) if all(s == 1 for s in strides) else "SAME"
    return tuple(tuple(int(v) for v in p) if isinstance(p, (tuple, list)) else (int(p), int(p)) for p in padding)


def _conv(t: Any, f: Any, kind: str) -> list[Differs] | None:
    if not isinstance(f, Conv) or isinstance(f, ConvTranspose) != kind.startswith("ConvTranspose"):
        return None
    n = f._rank
    kernel = tuple(int(k) for k in t.kernel_size)
    stride, dilation = _sizes(t.stride, n), _sizes(t.dilation, n)
    rows = [("stride", stride, "strides", tuple(f.strides), f"strides={stride}"),
            ("dilation", dilation, "dilation", tuple(f.dilation), f"dilation={dilation}"),
            ("groups", int(t.groups), "groups", int(f.groups), f"groups={int(t.groups)}")]
    if isinstance(f, ConvTranspose):  # torch's p, op: (d (k - 1) - p, d (k - 1) - p + op) here
        pads = tuple((d * (k - 1) - p, d * (k - 1) - p + op) for k, d, p, op in
                     zip(kernel, dilation, _sizes(t.padding, n), _sizes(t.output_padding, n)))
        mine = transpose_padding(kernel, f.strides, f.dilation, f.padding)
        rows.append(("padding, output_padding", (tuple(t.padding), tuple(t.output_padding)), "padding", f.padding,
                     f"padding={pads}"))
        differs = _options(rows[:3]) + ([Differs(*rows[3])] if tuple(map(tuple, mine)) != pads else [])
    else:
        pads = _pairs(t.padding, kernel, stride, dilation)
        mine = _pairs(f.padding, kernel, tuple(f.strides), tuple(f.dilation))
        given = t.padding if isinstance(t.padding, str) else tuple(t.padding)
        right = f"padding={given!r}" if isinstance(given, str) or len(set(given)) > 1 else f"padding={given[0]}"
        rows += [("padding_mode", t.padding_mode, "padding_mode", f.padding_mode, f"padding_mode={t.padding_mode!r}")]
        differs = _options(rows) + ([Differs("padding", given, "padding", f.padding, right)] if mine != pads else [])
    return differs + _activation_absent(f)


def _activation_absent(f: Any) -> list[Differs]:
    """A ``Dense`` or ``Conv`` with an activation of its own, where torch's layer has none."""
    activation = getattr(f, "activation", identity)
    if activation is identity or activation is None:
        return []
    return [Differs("activation", None, "activation", activation, "activation=None")]


def _linear(t: Any, f: Any, kind: str) -> list[Differs] | None:
    return _activation_absent(f) if isinstance(f, Dense) else None


def _norm(t: Any, f: Any, kind: str) -> list[Differs] | None:
    if kind == "LayerNorm" and isinstance(f, LayerNorm):
        shape = tuple(int(s) for s in t.normalized_shape)
        return _options([("eps", float(t.eps), "epsilon", f.epsilon, f"epsilon={float(t.eps)!r}"),
                         ("normalized_shape", shape, "shape", tuple(f.shape), f"shape={shape}")])
    if kind == "GroupNorm" and isinstance(f, GroupNorm):
        return _options([("num_groups", int(t.num_groups), "groups", f.groups, f"groups={int(t.num_groups)}"),
                         ("eps", float(t.eps), "epsilon", f.epsilon, f"epsilon={float(t.eps)!r}")])
    if kind == "RMSNorm" and isinstance(f, RMSNorm):
        return _options([("eps", t.eps, "epsilon", f.epsilon, f"epsilon={t.eps!r}")])
    if isinstance(f, (BatchNorm, _InstanceNorm)) and ("BatchNorm" in kind) == isinstance(f, BatchNorm):
        differs = _options([("eps", float(t.eps), "epsilon", f.epsilon, f"epsilon={float(t.eps)!r}")])
        if not (t.track_running_stats and f.track_running_stats):  # no statistics to train (or the tensors say so)
            return differs
        if t.momentum is None:  # BatchNorm's: a cumulative average; InstanceNorm's: momentum 0, never updated
            ours = None if isinstance(f, BatchNorm) else 1.0
            if f.momentum != ours:
                differs.append(Differs("momentum", None, "momentum", f.momentum, f"momentum={ours!r}"))
        elif f.momentum is None or _differ(round(1 - float(t.momentum), 12), f.momentum):  # torch's m weighs the new statistics, ft's the old
            ours = round(1 - float(t.momentum), 12)
            differs.append(Differs("momentum", float(t.momentum), "momentum", f.momentum, f"momentum={ours!r}"))
        if isinstance(f, BatchNorm) and not f.unbiased_running_variance:  # torch's running_var: unbiased
            differs.append(Differs("running_var (unbiased)", True, "unbiased_running_variance", False,
                                   "unbiased_running_variance=True"))
        return differs
    return None


def _embedding(t: Any, f: Any, kind: str) -> list[Differs] | None:
    bag = kind == "EmbeddingBag"
    if not isinstance(f, EmbeddingBag if bag else Embedding):
        return None
    f = _any(f)  # an EmbeddingBag's fields read where bag
    rows = [("padding_idx", t.padding_idx, "padding_index", f.padding_index, f"padding_index={t.padding_idx!r}"),
            ("scale_grad_by_freq", bool(t.scale_grad_by_freq), "scale_grad_by_freq", f.scale_grad_by_freq,
             f"scale_grad_by_freq={bool(t.scale_grad_by_freq)}")]
    if bag:
        rows += [("mode", t.mode, "mode", f.mode, f"mode={t.mode!r}"),
                 ("include_last_offset", bool(t.include_last_offset), "include_last_offset", f.include_last_offset,
                  f"include_last_offset={bool(t.include_last_offset)}")]
    differs = _options(rows)
    if t.max_norm is not None:
        differs.append(Differs("max_norm", t.max_norm, "", None, None, NO_MAX_NORM))
    return differs


def _cells(f: Any) -> list[RNN] | None:
    """The ``ft.nn.RNN`` layers of an ``RNN``, ``Bidirectional`` or ``StackedRNN``."""
    layers = f.layers if isinstance(f, StackedRNN) else (f,) if isinstance(f, (RNN, Bidirectional)) else None
    if layers is None:
        return None
    rnns = [r for layer in layers for r in ((layer.forward, layer.backward) if isinstance(layer, Bidirectional)
                                            else (layer,))]
    return rnns if all(isinstance(r, RNN) for r in rnns) else None


def _recurrent(t: Any, f: Any, kind: str) -> list[Differs] | None:
    rnns = _cells(f)
    if rnns is None:
        return None
    axes = sorted({int(r.time_axis) for r in rnns})
    stacked = isinstance(f, StackedRNN)
    if stacked:
        differs = _options([("batch_first", bool(t.batch_first), "batch_first", axes == [-2],
                             f"batch_first={bool(t.batch_first)}")])
        if t.num_layers > 1:  # between layers, in training
            differs += _options([("dropout", float(t.dropout), "dropout", f.dropout.rate, f"dropout={float(t.dropout)!r}")])
    else:  # ft.nn.RNN: time_axis -2 reads [*batch, time, features], 0 torch's default [time, batch, features]
        want = -2 if t.batch_first else 0
        differs = [] if axes == [want] else [Differs("batch_first", bool(t.batch_first), "time_axis",
                                                     axes[0] if len(axes) == 1 else tuple(axes), f"time_axis={want}")]
    if kind == "RNN":
        differs += _nonlinearity(t.nonlinearity, [r.cell for r in rnns], "stacked" if stacked else "rnn")
    return differs


def _nonlinearity(nonlinearity: str, cells: list[Any], where: str) -> list[Differs]:
    """torch's ``nonlinearity`` against the cells' activations (``where``: ``"stacked"``, a
    ``SimpleRNN``'s argument; ``"rnn"``, an ``RNN``'s cell; ``"cell"``, the cell's own)."""
    names = {getattr(a, "__name__", repr(a)) for c in cells for a in [getattr(c, "activation", None)]}
    if names == {nonlinearity}:
        return []
    fix = {"stacked": f"nonlinearity={nonlinearity!r}", "cell": f"activation=ft.nn.{nonlinearity}",
           "rnn": f"cell=ft.nn.SimpleRNNCell(..., activation=ft.nn.{nonlinearity})"}[where]
    return [Differs("nonlinearity", nonlinearity, {"stacked": "nonlinearity", "cell": "activation"}.get(
        where, "cell.activation"), ", ".join(sorted(names)), fix)]


def _rnn_cell(t: Any, f: Any, kind: str) -> list[Differs] | None:
    return _nonlinearity(t.nonlinearity, [f], "cell") if isinstance(f, SimpleRNNCell) else None


def _attention(t: Any, f: Any, kind: str, *, standalone: bool = True, layer: str = "") -> list[Differs] | None:
    if not isinstance(f, MultiheadAttention):
        return None
    heads = "nhead" if layer else "num_heads"
    rows = [("num_heads", int(t.num_heads), "num_heads", f.num_heads, f"{heads}={int(t.num_heads)}"),
            ("num_heads (key and value heads)", int(t.num_heads), "num_kv_heads", f.num_kv_heads,
             f"num_kv_heads={int(t.num_heads)}")]
    differs = _options(rows if not layer else rows[:1])
    if not layer:
        differs += _options([("dropout", float(t.dropout), "dropout", f.dropout, f"dropout={float(t.dropout)!r}")])
    if not layer:
        differs += _options([("add_zero_attn", bool(t.add_zero_attn), "add_zero_attn", f.add_zero_attn,
                              f"add_zero_attn={bool(t.add_zero_attn)}")])
    elif bool(t.add_zero_attn) != f.add_zero_attn:  # a transformer layer's argument has none
        differs.append(Differs("add_zero_attn", bool(t.add_zero_attn), "add_zero_attn", f.add_zero_attn, None,
                               NO_ZERO_ATTN))
    if standalone:  # a transformer layer's batch_first is its own (its attention is batch-first)
        differs += _options([("batch_first", bool(t.batch_first), "batch_first", f.batch_first,
                              f"batch_first={bool(t.batch_first)}")])
    return differs


def _transformer_layer(t: Any, f: Any, kind: str) -> list[Differs] | None:
    decoder = kind == "TransformerDecoderLayer"
    if not isinstance(f, TransformerDecoderLayer if decoder else TransformerEncoderLayer):
        return None
    rows = [("norm_first", bool(t.norm_first), "norm_first", f.norm_first, f"norm_first={bool(t.norm_first)}"),
            ("batch_first", bool(t.self_attn.batch_first), "batch_first", f.batch_first,
             f"batch_first={bool(t.self_attn.batch_first)}"),
            ("layer_norm_eps", float(t.norm1.eps), "norm1.epsilon", f.norm1.epsilon,
             f"layer_norm_eps={float(t.norm1.eps)!r}"),
            ("dropout", float(t.dropout.p), "dropout.rate", f.dropout.rate, f"dropout={float(t.dropout.p)!r}")]
    differs = _options(rows)
    for name in ("self_attn", "multihead_attn") if decoder else ("self_attn",):
        differs += [dataclasses.replace(d, option=f"{name}.{d.option}", ft_option=f"{name}.{d.ft_option}")
                    for d in _attention(getattr(t, name), getattr(f, name), kind, standalone=False, layer=kind) or []]
    if not _same_function(t.activation, f.activation):
        fix = _activation_fix(t.activation, argument=True)
        differs.append(Differs("activation", t.activation, "activation", f.activation, fix))
    return differs


def _activation_fix(activation: Any, argument: bool = False) -> str:
    """ft.nn's function for torch's activation (a function, or a module); ``argument``: as a
    transformer layer's ``activation=`` (``"relu"``, ``"gelu"``: exact, as torch's)."""
    name = getattr(activation, "__name__", type(activation).__name__).lower()
    if name == "gelu":  # ft.nn.gelu is the tanh approximation
        exact = getattr(activation, "approximate", "none") != "tanh"
        ours = "ft.nn.gelu_exact" if exact else "ft.nn.gelu"
        return ('activation="gelu"' if exact else f"activation={ours}") if argument else ours
    if argument and name == "relu":
        return 'activation="relu"'
    ours = f"ft.nn.{name}" if callable(getattr(activations, name, None)) else f"<a function equal to torch's {_show(activation)}>"
    return f"activation={ours}" if argument else ours


# Probe points of an activation: both sides of 0, the tails, float32 (torch's and JAX's defaults).
# Past 6 on both sides: ReLU6 and relu (Hardtanh(-6, 6) and identity) agree on [-6, 6].
_PROBE = np.linspace(-8.0, 8.0, 65, dtype=np.float32)


def _same_function(torch_fn: Any, ft_fn: Any) -> bool:
    """Whether an elementwise torch activation (a module or a function) and an ft one agree on
    :data:`_PROBE` (float32; to ``1e-5`` of the outputs' magnitude, gelu's exact and tanh forms
    differing by ``4.7e-4``); True where either fails on the probe (no elementwise function)."""
    import torch

    try:
        with torch.no_grad():
            want = np.asarray(torch_fn(torch.from_numpy(_PROBE.copy())).numpy(), np.float64)
        got = _probed(ft_fn)
    except Exception:
        return True
    if want.shape != got.shape:
        return True
    return bool(np.abs(want - got).max(initial=0) <= 1e-5 * max(1.0, float(np.abs(want).max(initial=0))))


@functools.lru_cache(maxsize=256)
def _probed(fn: Callable[[Any], Any]) -> np.ndarray:
    """``fn`` on :data:`_PROBE`, compiled once (op by op, each of its operations compiled: 0.2 s for gelu)."""
    return np.asarray(jax.jit(fn)(_PROBE), np.float64)


def _activation_module(t: Any, f: Any, kind: str) -> list[Differs] | None:
    """A torch activation module against the ft step at its name: a function in a
    ``Sequential`` (``Lambda``), or a layer without arrays."""
    if not isinstance(f, Lambda):
        return None
    if _same_function(t, f.fn):
        return []
    return [Differs("function", t, "function", f.fn, _activation_fix(t))]


def _dropout(t: Any, f: Any, kind: str) -> list[Differs] | None:
    if not isinstance(f, Dropout):
        return None
    return _options([("p", float(t.p), "rate", f.rate, f"rate={float(t.p)!r}")])


def _pool(t: Any, f: Any, kind: str) -> list[Differs] | None:
    is_max = kind.startswith("Max")
    if not isinstance(f, _MaxPool if is_max else _AvgPool):
        return None
    f = _any(f)  # a max pool's or an average pool's fields, by is_max
    n = f._rank
    kernel = _sizes(t.kernel_size, n)
    stride = _sizes(t.stride if t.stride is not None else t.kernel_size, n)
    dilation = _sizes(getattr(t, "dilation", 1), n)
    rows = [("kernel_size", kernel, "pool_size", tuple(f.pool_size), f"pool_size={kernel}"),
            ("stride", stride, "strides", tuple(f.strides), f"strides={stride}"),
            ("ceil_mode", bool(t.ceil_mode), "ceil_mode", f.ceil_mode, f"ceil_mode={bool(t.ceil_mode)}")]
    if is_max:
        rows.append(("dilation", dilation, "dilation", tuple(f.dilation), f"dilation={dilation}"))
    else:
        rows += [("count_include_pad", bool(t.count_include_pad), "count_include_pad", f.count_include_pad,
                  f"count_include_pad={bool(t.count_include_pad)}"),
                 ("divisor_override", getattr(t, "divisor_override", None), "divisor_override", f.divisor_override,
                  f"divisor_override={getattr(t, 'divisor_override', None)!r}")]
    differs = _options(rows)
    pads = tuple((p, p) for p in _sizes(t.padding, n))
    if _pairs(f.padding, kernel, stride, dilation if is_max else (1,) * n) != pads:
        differs.append(Differs("padding", t.padding, "padding", f.padding, f"padding={t.padding!r}"))
    return differs


def _rrelu(t: Any, f: Any, kind: str) -> list[Differs] | None:
    if not isinstance(f, RReLU):
        return None
    return _options([("lower", float(t.lower), "lower", f.lower, f"lower={float(t.lower)!r}"),
                     ("upper", float(t.upper), "upper", f.upper, f"upper={float(t.upper)!r}")])


def _fractional_pool(t: Any, f: Any, kind: str) -> list[Differs] | None:
    """A fractional max pool's window and output (no tensor holds them)."""
    if not isinstance(f, _FractionalMaxPool):
        return None
    n = f._rank
    size = None if t.output_size is None else _sizes(t.output_size, n)
    ratio = None if t.output_ratio is None else tuple(float(r) for r in (
        (t.output_ratio,) * n if isinstance(t.output_ratio, (int, float)) else t.output_ratio))
    kernel = _sizes(t.kernel_size, n)
    return _options([("kernel_size", kernel, "pool_size", tuple(f.pool_size), f"pool_size={kernel}"),
                     ("output_size", size, "output_size", f.output_size, f"output_size={size}"),
                     ("output_ratio", ratio, "output_ratio", f.output_ratio, f"output_ratio={ratio}"),
                     ("return_indices", bool(t.return_indices), "return_indices", f.return_indices,
                      f"return_indices={bool(t.return_indices)}")])


def _adaptive_pool(t: Any, f: Any, kind: str) -> list[Differs] | None:
    """An adaptive pool's output size (None entries: the input's), and a max's ``return_indices``."""
    is_max = kind.startswith("AdaptiveMax")
    if not isinstance(f, _AdaptivePool) or isinstance(f, _AdaptiveMaxPool) != is_max:
        return None
    n = f._rank
    given = t.output_size
    size = tuple(None if v is None else int(v) for v in (given if isinstance(given, (tuple, list)) else (given,) * n))
    rows: list[tuple[str, Any, str, Any, str]] = [
        ("output_size", size, "output_size", tuple(f.output_size), f"output_size={size}")]
    if is_max:
        rows.append(("return_indices", bool(t.return_indices), "return_indices", _any(f).return_indices,
                     f"return_indices={bool(t.return_indices)}"))
    return _options(rows)


def _unpool(t: Any, f: Any, kind: str) -> list[Differs] | None:
    """A max unpool's window (where its output size is not given, the outputs' size)."""
    if not isinstance(f, _MaxUnpool):
        return None
    n = f._rank
    kernel, padding = _sizes(t.kernel_size, n), _sizes(t.padding, n)
    stride = _sizes(t.stride if t.stride is not None else t.kernel_size, n)
    return _options([("kernel_size", kernel, "pool_size", tuple(f.pool_size), f"pool_size={kernel}"),
                     ("stride", stride, "strides", tuple(f.strides), f"strides={stride}"),
                     ("padding", padding, "padding", tuple(f.padding), f"padding={padding}")])


def _lp_pool(t: Any, f: Any, kind: str) -> list[Differs] | None:
    if not isinstance(f, _LPPool):
        return None
    n = f._rank
    kernel = _sizes(t.kernel_size, n)
    stride = _sizes(t.stride if t.stride is not None else t.kernel_size, n)
    return _options([("norm_type", float(t.norm_type), "norm_type", f.norm_type, f"norm_type={float(t.norm_type)!r}"),
                     ("kernel_size", kernel, "pool_size", tuple(f.pool_size), f"pool_size={kernel}"),
                     ("stride", stride, "strides", tuple(f.strides), f"strides={stride}"),
                     ("ceil_mode", bool(t.ceil_mode), "ceil_mode", f.ceil_mode, f"ceil_mode={bool(t.ceil_mode)}")])


def _upsample(t: Any, f: Any, kind: str) -> list[Differs] | None:
    """An ``Upsample``'s (``UpsamplingNearest2d``'s, ``UpsamplingBilinear2d``'s) mode, size or
    scale and the flags that move its taps: bilinear read as nearest keeps every shape."""
    if not isinstance(f, _Upsample):
        return None
    n = f._rank

    def per_axis(value: Any, cast: Any) -> Any:
        return None if value is None else tuple(cast(v) for v in (
            value if isinstance(value, (tuple, list)) else (value,) * n))

    size, scale = per_axis(t.size, int), per_axis(t.scale_factor, float)
    align, recompute = bool(t.align_corners), bool(t.recompute_scale_factor)
    return _options([("mode", t.mode, "mode", f.mode, f"mode={t.mode!r}"),
                     ("size", size, "size", f.size, f"size={size}"),
                     ("scale_factor", scale, "scale_factor", f.scale_factor, f"scale_factor={scale}"),
                     ("align_corners", align, "align_corners", f.align_corners, f"align_corners={align}"),
                     ("recompute_scale_factor", recompute, "recompute_scale_factor", f.recompute_scale_factor,
                      f"recompute_scale_factor={recompute}")])


def _pad(t: Any, f: Any, kind: str) -> list[Differs] | None:
    """A pad's widths (torch's flat ``(left, right, top, bottom, ...)``, last axis first: pairs in
    the input's axis order here) and a constant pad's value; the mode is the class's."""
    mode = kind.split("Pad")[0]
    if not isinstance(f, _Pad) or type(f).__name__.split("Pad")[0] != mode:
        return None
    n = f._rank
    flat = tuple(int(v) for v in t.padding) if isinstance(t.padding, (tuple, list)) else (int(t.padding),) * 2 * n
    pairs = tuple((flat[2 * i], flat[2 * i + 1]) for i in reversed(range(n)))
    differs = _options([("padding", tuple(t.padding) if isinstance(t.padding, (tuple, list)) else t.padding,
                         "padding", tuple(f.padding), f"padding={pairs}")]) if pairs != tuple(f.padding) else []
    if isinstance(f, _ConstantPad):
        differs += _options([("value", float(t.value), "value", f.value, f"value={float(t.value)!r}")])
    return differs


def _shuffle(t: Any, f: Any, kind: str) -> list[Differs] | None:
    """A pixel (un)shuffle's factor, a channel shuffle's groups (the same shape for any groups)."""
    if kind == "ChannelShuffle":
        return _options([("groups", int(t.groups), "groups", f.groups, f"groups={int(t.groups)}")]) if isinstance(
            f, ChannelShuffle) else None
    cls, option = (PixelShuffle, "upscale_factor") if kind == "PixelShuffle" else (PixelUnshuffle, "downscale_factor")
    if not isinstance(f, cls):
        return None
    factor = int(getattr(t, option))
    return _options([(option, factor, "factor", f.factor, f"factor={factor}")])


def _local_response_norm(t: Any, f: Any, kind: str) -> list[Differs] | None:
    if not isinstance(f, LocalResponseNorm):
        return None
    return _options([("size", int(t.size), "size", f.size, f"size={int(t.size)}"),
                     ("alpha", float(t.alpha), "alpha", f.alpha, f"alpha={float(t.alpha)!r}"),
                     ("beta", float(t.beta), "beta", f.beta, f"beta={float(t.beta)!r}"),
                     ("k", float(t.k), "k", f.k, f"k={float(t.k)!r}")])


_ACTIVATIONS = ("ReLU", "ReLU6", "LeakyReLU", "ELU", "SELU", "CELU", "GELU", "SiLU", "Mish", "Sigmoid", "Tanh",
                "Softplus", "Softsign", "Hardtanh", "Hardswish", "Hardsigmoid", "Hardshrink", "Softshrink",
                "Tanhshrink", "LogSigmoid", "Threshold")

# torch's class name → its comparison with the ft layer at its name (None: not that layer's
# counterpart, left to the tensors' checks).
_CHECKS: dict[str, Callable[[Any, Any, str], list[Differs] | None]] = {
    **{f"Conv{n}d": _conv for n in (1, 2, 3)}, **{f"ConvTranspose{n}d": _conv for n in (1, 2, 3)},
    "Linear": _linear, "LayerNorm": _norm, "GroupNorm": _norm, "RMSNorm": _norm,
    **{f"BatchNorm{n}d": _norm for n in (1, 2, 3)}, "SyncBatchNorm": _norm,
    **{f"InstanceNorm{n}d": _norm for n in (1, 2, 3)},
    "Embedding": _embedding, "EmbeddingBag": _embedding,
    "RNN": _recurrent, "GRU": _recurrent, "LSTM": _recurrent, "RNNCell": _rnn_cell,
    "MultiheadAttention": _attention,
    "TransformerEncoderLayer": _transformer_layer, "TransformerDecoderLayer": _transformer_layer,
    **{name: _dropout for name in ("Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout",
                                   "FeatureAlphaDropout")},
    **{f"{k}Pool{n}d": _pool for k in ("Max", "Avg") for n in (1, 2, 3)},
    **{name: _activation_module for name in _ACTIVATIONS},
    "RReLU": _rrelu, "FractionalMaxPool2d": _fractional_pool, "FractionalMaxPool3d": _fractional_pool,
    **{f"Adaptive{k}Pool{n}d": _adaptive_pool for k in ("Max", "Avg") for n in (1, 2, 3)},
    **{f"LPPool{n}d": _lp_pool for n in (1, 2, 3)}, **{f"MaxUnpool{n}d": _unpool for n in (1, 2, 3)},
    "Upsample": _upsample, "UpsamplingNearest2d": _upsample, "UpsamplingBilinear2d": _upsample,
    **{f"{mode}Pad{n}d": _pad for mode in ("Zero", "Constant", "Reflection", "Replication", "Circular")
       for n in (1, 2, 3)},
    "PixelShuffle": _shuffle, "PixelUnshuffle": _shuffle, "ChannelShuffle": _shuffle,
    "LocalResponseNorm": _local_response_norm,
}

