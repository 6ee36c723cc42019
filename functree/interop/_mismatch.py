"""The error of a state dict that does not fit the model (:func:`ft.nn.load_torch_state_dict`):
the report by torch name, what the model's torch names look like, and a ``layouts=``
suggestion where an attention's tensors, or a Dense layer's weight, are there in another layout."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from functree._state_dict import FlatDictReport

__all__ = ["mismatch_error"]

TORCH_MISMATCH = """\
ft.nn.load_torch_state_dict: the state dict does not fit the model (names as torch spells them).
{report}
{names}Map differing prefixes with rename={{"torch.prefix": "model.prefix"}}, or pass strict=False \
to load what fits and get this report back: model, report = ft.nn.load_torch_state_dict(model, sd, strict=False){hint}"""

TORCH_NAMES = """\
The model's torch names are its key paths without Sequential's "layers" (a Stack's members \
are h.0, h.1, ...), e.g. {example}.
"""

LAYOUTS_HINT = """
The attention {layer} (ft.nn.MultiheadAttention: torch's in_proj_weight and out_proj) is \
missing its tensors while the state dict has {given}: another layout, read with layouts=:

    right:  ft.nn.load_torch_state_dict(model, sd, layouts={{{pattern!r}: {layout!r}}})"""


DENSE_LAYOUTS_HINT = """
The Dense weights of {layers} are given as [in, out], their [out, in] shape reversed: Hugging \
Face's Conv1D (GPT-2) stores them so. Neither rename= nor strict=False reads them; layouts= does:

    wrong:  ft.nn.load_torch_state_dict(model, sd)
    right:  ft.nn.load_torch_state_dict(model, sd, layouts={layouts})

Square Dense layers ([n, n]) of the same state dict need "conv1d" too: their shape cannot tell \
[in, out] from [out, in], so they load transposed without an error. Add their names (or one \
pattern covering every Conv1D layer, "*" where all of them are)."""


RNN_DIRECTION_HINT = """
The RNN {layer} runs {mine}: torch names its tensors {want}; the state dict has {given}, \
a layer reading the sequence {theirs} ({torch_layer}). Loaded into this RNN they would compute \
another function: build the RNN of their direction.

    wrong:  ft.nn.RNN(cell{mine_arg})
    right:  ft.nn.RNN(cell{theirs_arg})   # as {torch_layer} runs"""

NO_RUNNING_STATISTICS_HINT = """
The state dict holds no running statistics for {layers} (no {names}): torch's BatchNorm*d / InstanceNorm*d(..., track_running_stats=False), which normalizes with each batch's own statistics in eval too. Build the layer so: strict=False would keep the initial statistics (0 and 1) and give other numbers in inference, without an error.

    wrong:  ft.nn.load_torch_state_dict(model, sd, strict=False)
    right:  ft.nn.BatchNorm(features, track_running_stats=False)   # InstanceNorm2D(..., track_running_stats=False)"""


def _statistics_hint(report: FlatDictReport) -> str:
    """:data:`NO_RUNNING_STATISTICS_HINT` where a layer misses both its ``running_mean`` and
    ``running_var`` (the state dict of a torch norm without tracked statistics)."""
    missing = set(report.missing)
    layers = [name.removesuffix("running_mean") for name in report.missing
              if name.endswith("running_mean") and name.removesuffix("running_mean") + "running_var" in missing]
    if not layers:
        return ""
    shown = ", ".join(layer.rstrip(".") or "(the model)" for layer in layers[:3]) + (", ..." if len(layers) > 3 else "")
    names = f"{layers[0]}running_mean, {layers[0]}running_var"
    return NO_RUNNING_STATISTICS_HINT.format(layers=shown, names=names)


_FORWARD = ("forward", "", "torch.nn.GRU / LSTM(..., batch_first=True)")
_REVERSE = ("from its end", ", reverse=True", "the reverse direction of torch's bidirectional=True GRU / LSTM")


def _rnn_direction_hint(report: FlatDictReport) -> str:
    """:data:`RNN_DIRECTION_HINT` where an RNN misses its ``_l0`` tensors (or ``_l0_reverse``)
    and the state dict has the other direction's under its name."""
    for want in report.missing:
        other = want.removesuffix("_reverse") if want.endswith("_l0_reverse") else want + "_reverse"
        if not want.endswith(("_l0", "_l0_reverse")) or other not in report.unexpected:
            continue
        mine, theirs = (_REVERSE, _FORWARD) if want.endswith("_reverse") else (_FORWARD, _REVERSE)
        layer = want.rsplit(".", 1)[0] if "." in want else "(the model)"
        return RNN_DIRECTION_HINT.format(layer=layer, mine=mine[0], want=want, given=other, theirs=theirs[0],
                                         torch_layer=theirs[2], mine_arg=mine[1], theirs_arg=theirs[1])
    return ""


_ROLES = (("q", "query"), ("k", "key"), ("v", "value"), ("o", "out", "output", "dense", "proj"))


def _layouts_hint(attentions: Sequence[str], report: FlatDictReport) -> str:
    """A ``layouts=`` suggestion where an attention misses its tensors and the state dict
    has others under its name (separate q/k/v/o Linears, GPT-2's fused c_attn)."""
    for layer in attentions:
        if not any(n.startswith(layer + ".") for n in report.missing):
            continue
        extra = [n[len(layer) + 1:] for n in report.unexpected if n.startswith(layer + ".")]
        subs = list(dict.fromkeys(n.rsplit(".", 1)[0] for n in extra if n.endswith((".weight", ".bias"))))
        if not subs:
            continue
        pattern = ".".join("*" if part.isdigit() else part for part in layer.split("."))
        if "c_attn" in subs:
            return LAYOUTS_HINT.format(layer=layer, given=extra, pattern=pattern, layout="conv1d")
        if len(subs) != 4:
            continue
        ordered = sorted(subs, key=lambda sub: next((i for i, words in enumerate(_ROLES)
                                                     if sub.split(".")[-1].split("_")[0] in words), 3))
        return LAYOUTS_HINT.format(layer=layer, given=extra, pattern=pattern, layout=tuple(ordered))
    return ""


_SHAPE = re.compile(r"shape \(([\d, ]*)\)")


def _shape(described: str) -> tuple[int, ...]:
    """The shape a report's ``"shape (32, 8) (for c_fc.weight)"`` names (``()`` for none)."""
    found = _SHAPE.match(described)
    return tuple(int(d) for d in found.group(1).replace(",", " ").split()) if found else ()


def _dense_layouts_hint(rules: Sequence[Any], attentions: Sequence[str], report: FlatDictReport) -> str:
    """:data:`DENSE_LAYOUTS_HINT` where a Dense layer's ``weight`` is given as its expected
    ``[out, in]`` reversed. A Dense rule maps one torch ``<layer>.weight`` onto one ft
    ``<layer>.weight`` (an Embedding's leaf is ``embeddings``, a cell's ``input_weight``), 2-D
    (a convolution's is 3-D or more); an attention's own are :func:`_layouts_hint`'s."""
    dense = {r.torch[0] for r in rules if len(r.torch) == len(r.ft) == 1
             and r.torch[0].rsplit(".", 1)[-1] == "weight" == r.ft[0].rsplit(".", 1)[-1]}
    layers = [name.rsplit(".", 1)[0] if "." in name else "" for name, want, given in report.mismatched
              if name in dense and not any(name.startswith(a + ".") for a in attentions)
              and len(_shape(want)) == 2 and _shape(given) == _shape(want)[::-1]]
    patterns = list(dict.fromkeys(".".join("*" if p.isdigit() else p for p in layer.split(".")) for layer in layers))
    if not patterns:
        return ""
    return DENSE_LAYOUTS_HINT.format(layers=", ".join(patterns) if any(patterns) else "the model",
                                     layouts={pattern: "conv1d" for pattern in patterns})


def mismatch_error(rules: Sequence[Any], attentions: Sequence[str], report: FlatDictReport, hint: str = "") -> ValueError:
    """:data:`TORCH_MISMATCH` for ``report``: an example of the rules' names (each with ``ft``
    and ``torch`` names: ``key path -> torch name``), the attentions' and Dense layers'
    ``layouts=`` hints, an RNN's direction, and ``hint`` (the ports')."""
    example = next((f"{r.ft[0]} -> {r.torch[0]}" for r in rules if "layers" in r.ft[0]), None) or next(
        (f"{r.ft[0]} -> {r.torch[0]}" if r.ft[0] != r.torch[0] else r.torch[0] for r in rules[:1]), "")
    names = TORCH_NAMES.format(example=example) if rules else ""
    return ValueError(TORCH_MISMATCH.format(report=report, names=names,
                                            hint=_layouts_hint(attentions, report) + _dense_layouts_hint(rules, attentions, report)
                                            + _rnn_direction_hint(report) + _statistics_hint(report) + hint))
