"""What a mismatch error adds where the state dict holds torch's multi-layer or bidirectional
``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN``: the ``ft.nn`` constructor of the same module, read off
its tensors' names (``weight_ih_l{k}``, ``_reverse``) and shapes (gates = rows of
``weight_ih`` / columns of ``weight_hh``: 4 an LSTM, 3 a GRU, 1 an Elman RNN)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from functree._state_dict import FlatDictReport

__all__ = ["RNN_STACK_HINT", "recurrent_hint"]

RNN_STACK_HINT = """
The state dict holds torch's {layers}-layer{bidirectional} {torch_kind}{where} ({names}), which is \
ft.nn.{kind} with those settings (an ft.nn.RNN is one layer, one direction); build it so \
(batch_first as torch's module had it: False is torch's default, [time, batch, features]{relu}):

    right:  ft.nn.{kind}({inputs}, {hidden}{options}, batch_first=False, key=k)"""

_KINDS = {4: ("LSTM", "nn.LSTM"), 3: ("GRU", "nn.GRU"), 1: ("SimpleRNN", "nn.RNN")}
_LAYER = re.compile(r"^(?P<prefix>(?:.*\.)?)weight_ih_l(?P<k>\d+)(?P<reverse>_reverse)?$")
_PROJECTION = re.compile(r"^(?P<prefix>(?:.*\.)?)weight_hr_l\d+(_reverse)?$")


def recurrent_hint(report: FlatDictReport, given: Mapping[str, Any]) -> str:
    """:data:`RNN_STACK_HINT` for the first torch recurrent module whose further layers or
    reverse direction or projections (``proj_size``) the model left unmatched (its names among
    ``report``'s unexpected)."""
    for name in report.unexpected:
        found = _LAYER.match(name) or _PROJECTION.match(name)  # a projection: torch's proj_size, one layer too
        if found is None or (found.re is _LAYER and found["k"] == "0" and not found["reverse"]):
            continue
        prefix = found["prefix"]
        first, hidden = given.get(f"{prefix}weight_ih_l0"), given.get(f"{prefix}weight_hh_l0")
        if first is None or hidden is None or len(first.shape) != 2 or len(hidden.shape) != 2 or not hidden.shape[1]:
            continue
        projection = given.get(f"{prefix}weight_hr_l0")  # torch's LSTM with proj_size: weight_hh [4H, p]
        size = int(projection.shape[1]) if projection is not None and len(projection.shape) == 2 \
            else int(hidden.shape[1])
        kinds = _KINDS.get(int(first.shape[0]) // size) if size else None
        if kinds is None:
            continue
        layers = [m for m in map(_LAYER.match, given) if m is not None and m["prefix"] == prefix]
        count = 1 + max(int(m["k"]) for m in layers)
        bidirectional = any(m["reverse"] for m in layers)
        options = (f", num_layers={count}" if count > 1 else "") + (", bidirectional=True" if bidirectional else "")
        options += "" if f"{prefix}bias_ih_l0" in given else ", bias=False"
        options += f", proj_size={int(projection.shape[0])}" if projection is not None and size != int(hidden.shape[1]) else ""
        return RNN_STACK_HINT.format(
            layers=count, bidirectional=" bidirectional" if bidirectional else "", torch_kind=kinds[1],
            where=f" under {prefix[:-1]!r}" if prefix else "",
            names=f"{prefix}weight_ih_l0 ... {prefix}weight_ih_l{count - 1}" + ("_reverse" if bidirectional else ""),
            kind=kinds[0], inputs=int(first.shape[1]), hidden=size, options=options,
            relu="; nonlinearity=\"relu\" if torch's had it" if kinds[0] == "SimpleRNN" else "")
    return ""
