"""The error of a state dict that does not fit the model (:func:`ft.nn.load_torch_state_dict`):
the report by torch name, what the model's torch names look like, and a ``layouts=``
suggestion where an attention's tensors, or a Dense layer's weight, are there in another layout."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from functree._state_dict import FlatDictReport
from functree.nn._attention import MultiheadAttention
from functree.nn._bilinear import Bilinear
from functree.nn._conv import Conv, ConvTranspose
from functree.nn._embedding import Embedding
from functree.nn._linear import Dense
from functree.nn._normalization import BatchNorm, GroupNorm, LayerNorm, RMSNorm, _InstanceNorm
from functree.nn._recurrent import RNN, GRUCell, LSTMCell, SimpleRNNCell
from functree.nn._recurrent_layers import Bidirectional, StackedRNN

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


OPTION_HINT = """
The state dict holds {tensors} for {layer}, an ft.nn.{kind} built without {them}: its torch \
module had {what}. strict=False would drop {them} and compute other numbers, without an error. \
Build the layer with the option (or the block that builds it with the block's):

    right:  {right}"""

NO_COUNTERPART_HINT = """
The state dict holds {tensors} for {layer}, an ft.nn.MultiheadAttention: torch's \
MultiheadAttention(..., add_bias_kv=True), a learned key and value appended to every \
sequence, which ft.nn.MultiheadAttention has no option for. strict=False would drop them and \
compute other numbers, without an error: this torch module has no ft.nn port."""

PARAMETRIZED_HINT = """
The state dict holds {layer}'s {weight} as {tensors}, torch's {kind}, not the tensor \
itself. strict=False would keep the layer's initial {weight}: a silently different model. \
Save the tensor torch computes from them, in torch:

    wrong:  sd = module.state_dict()
    right:  {remove}
            sd = module.state_dict()             # {name}, one tensor{keep}"""

# PARAMETRIZED_HINT's {keep}: torch's parametrizations of a weight, which ft.nn's wrappers read as they are.
KEEP_PARAMETRIZED = """
       or:  ft.nn.WeightNorm(layer) / ft.nn.SpectralNorm(layer, key=k)   # keep it trainable: reads parametrizations.weight.*"""

PREFIX_HINT = """
Every unexpected name is a missing one under {prefix!r} ({why}). Strip it:

    right:  ft.nn.load_torch_state_dict(model, sd, rename={{"{stripped}": ""}})"""

# The tensors a layer holds only with a torch option, by their local names: the option and the
# ft.nn constructor argument that gives the layer them (each a tensor strict=False would drop).
# A name ending in "_l" is an RNN's per-layer name (bias_ih_l0, bias_ih_l1_reverse).
_NORMS = (LayerNorm, GroupNorm, RMSNorm)
_OPTIONS: tuple[tuple[type | tuple[type, ...], tuple[str, ...], str, str], ...] = (
    ((Dense, Conv), ("bias",), "bias=True", "use_bias=True"),
    (Bilinear, ("bias",), "bias=True", "bias=True"),
    (_NORMS, ("weight",), "elementwise_affine=True", "use_scale=True"),
    (_NORMS, ("bias",), "elementwise_affine=True, bias=True", "use_offset=True"),
    (_InstanceNorm, ("weight", "bias"), "InstanceNorm*d(..., affine=True)", "affine=True"),
    (BatchNorm, ("weight", "bias"), "BatchNorm*d(..., affine=True), its default", "use_scale=True, use_offset=True"),
    ((BatchNorm, _InstanceNorm), ("running_mean", "running_var"),
     "track_running_stats=True: eval() normalizes with them, not with each batch's statistics",
     "track_running_stats=True"),
    (MultiheadAttention, ("in_proj_bias", "out_proj.bias"), "bias=True", "use_bias=True"),
    ((SimpleRNNCell, GRUCell, LSTMCell), ("bias_ih", "bias_hh"), "bias=True", "use_bias=True"),
    ((RNN, StackedRNN, Bidirectional), ("bias_ih_l", "bias_hh_l"), "bias=True", "bias=True"),
)


def _named(local: str, name: str) -> bool:
    """Whether the layer's torch tensor ``local`` is ``name`` (an RNN's ``bias_ih_l`` any layer's
    and direction's: ``bias_ih_l1_reverse``)."""
    return local == name or (name.endswith("_l") and re.fullmatch(re.escape(name) + r"\d+(_reverse)?", local) is not None)


def _shown(layer: str) -> str:
    return repr(layer) if layer else "the model"


def _option(layer: Any, local: str) -> tuple[str, str] | None:
    """The option ``layer`` was built without that gives it the torch tensor ``local``, and
    the constructor argument giving it; None for a tensor no option of its gives."""
    for cls, names, what, argument in _OPTIONS:
        if isinstance(layer, cls) and any(_named(local, n) for n in names):
            return what, argument
    return None


_PARAMETRIZED = {  # the tensor naming the parametrization -> its kind, its tensors, torch's removal
    "g": ("weight_norm (weight = g v / ||v||)", ("{w}_g", "{w}_v"), "torch.nn.utils.remove_weight_norm(layer)"),
    "orig": ("spectral_norm (weight = weight_orig / sigma)", ("{w}_orig", "{w}_u", "{w}_v"),
             "layer.eval(); torch.nn.utils.remove_spectral_norm(layer)   # sigma from the stored u, v"),
    "original": ("parametrization (torch.nn.utils.parametrizations: weight_norm, spectral_norm, orthogonal)",
                 ("parametrizations.{w}.",),
                 'layer.eval(); torch.nn.utils.parametrize.remove_parametrizations(layer, "{w}")'),
}
_PARAMETRIZATION = re.compile(r"(?P<w>\w+?)_(?P<kind>g|orig)|parametrizations\.(?P<p>\w+)\.(?P<original>original)\d*")


def _parametrized_hint(layer: str, missing: set[str], unexpected: Sequence[str]) -> str:
    """:data:`PARAMETRIZED_HINT` where ``layer`` misses a tensor its unexpected ones hold as a
    torch parametrization (``weight_g``/``weight_v``, ``parametrizations.weight.original0``)."""
    start = f"{layer}." if layer else ""
    for name in unexpected:
        found = _PARAMETRIZATION.fullmatch(name[len(start):])
        weight = "" if found is None else str(found["w"] or found["p"])
        if found is None or start + weight not in missing:
            continue
        kind, parts, remove = _PARAMETRIZED[found["kind"] or found["original"]]
        prefixes = tuple(start + part.format(w=weight) for part in parts)
        tensors = [n for n in unexpected if n in prefixes or (n.startswith(prefixes) and prefixes[0].endswith("."))]
        keep = KEEP_PARAMETRIZED if found["original"] and weight == "weight" else ""
        return PARAMETRIZED_HINT.format(layer=_shown(layer), kind=kind, tensors=", ".join(tensors),
                                        weight=weight, name=start + weight, remove=remove.format(w=weight), keep=keep)
    return ""


def _options_hint(layers: Mapping[str, Any], report: FlatDictReport) -> str:
    """:data:`OPTION_HINT` (:data:`NO_COUNTERPART_HINT`, :data:`PARAMETRIZED_HINT`) for the
    first known layer (``layers``: torch name -> layer) with unexpected tensors of its own: a
    torch option its ft.nn layer was built without, whose tensors strict=False would drop."""
    if not report.unexpected:
        return ""
    missing = set(report.missing)
    for layer, node in layers.items():
        start = f"{layer}." if layer else ""
        unexpected = [n for n in report.unexpected if n.startswith(start) and (
            "." not in n[len(start):] or n[len(start):] == "out_proj.bias"
            or n[len(start):].startswith("parametrizations."))]  # its own tensors, not a sublayer's
        parametrized = _parametrized_hint(layer, missing, unexpected)
        if parametrized:
            return parametrized
        kv = [n for n in unexpected if n[len(start):] in ("bias_k", "bias_v")]
        if kv and isinstance(node, MultiheadAttention):
            return NO_COUNTERPART_HINT.format(tensors=", ".join(kv), layer=_shown(layer))
        found = [(n, option) for n in unexpected for option in [_option(node, n[len(start):])] if option]
        if found:
            (what, argument), kind = found[0][1], type(node).__name__
            tensors = [n for n, option in found if option == found[0][1]]
            right = f"ft.nn.{kind}(..., {argument})"
            if isinstance(node, RNN):  # one direction of one layer: the option is its cell's
                right = f"ft.nn.RNN(ft.nn.{type(node.cell).__name__}(..., use_bias=True))"
            return OPTION_HINT.format(tensors=", ".join(tensors), kind=kind, layer=_shown(layer),
                                      them="them" if len(tensors) > 1 else "it", what=what, right=right)
    return ""


WITHOUT_HINT = """
The state dict has no {tensors} for {layer}, an ft.nn.{kind}: its torch module was built \
without {them} ({what}). Build the layer so, and its export is the torch module's state dict \
again (strict=False would load the same numbers, but keep {them} in the model and its export).{unsure}

    right:  {right}"""

# WITHOUT_HINT's {unsure}: the layer has no tensor in the state dict at all.
NO_TENSOR_OF_IT = """ No tensor of the layer is given, though: if torch's model has no such layer, the \
two models differ, and neither fix makes them compute the same numbers."""

# The tensors a torch option leaves out of a layer, by their local names: the option and the
# ft.nn argument that leaves them out too (running statistics: NO_RUNNING_STATISTICS_HINT).
_WITHOUT: tuple[tuple[type | tuple[type, ...], tuple[str, ...], str, str], ...] = (
    ((Dense, Conv), ("bias",), "bias=False", "use_bias=False"),
    (Bilinear, ("bias",), "bias=False", "bias=False"),
    (_NORMS, ("weight", "bias"), "elementwise_affine=False / GroupNorm's affine=False",
     "use_scale=False, use_offset=False"),
    (_NORMS, ("weight",), "elementwise_affine=False", "use_scale=False"),
    (_NORMS, ("bias",), "bias=False", "use_offset=False"),
    (_InstanceNorm, ("weight", "bias"), "affine=False, InstanceNorm's default", "affine=False"),
    (BatchNorm, ("weight", "bias"), "BatchNorm*d(..., affine=False)", "use_scale=False, use_offset=False"),
    (MultiheadAttention, ("in_proj_bias", "out_proj.bias"), "bias=False", "use_bias=False"),
    ((SimpleRNNCell, GRUCell, LSTMCell), ("bias_ih", "bias_hh"), "bias=False", "use_bias=False"),
    ((StackedRNN, Bidirectional), ("bias_ih_l", "bias_hh_l"), "bias=False", "bias=False"),
)


def _without_hint(layers: Mapping[str, Any], rules: Sequence[Any], report: FlatDictReport) -> str:
    """:data:`WITHOUT_HINT` for the first known layer whose
    missing tensors are exactly those a torch option leaves out, where nothing is unexpected
    (a name to map elsewhere would be). ``rules``: every layer's torch names, to tell a layer
    none of whose tensors is given (:data:`NO_TENSOR_OF_IT`)."""
    if report.unexpected or not report.missing:
        return ""
    for layer, node in layers.items():
        start = f"{layer}." if layer else ""
        own = {n[len(start):] for n in report.missing if n.startswith(start)} - {"running_mean", "running_var"}
        if not own or any("." in n and not n.startswith("out_proj.") for n in own):
            continue
        tensors = [n for n in report.missing if n.startswith(start) and n[len(start):] in own]
        held = any(t.startswith(start) and t not in report.missing for rule in rules for t in rule.torch)
        unsure = "" if held else NO_TENSOR_OF_IT
        for cls, names, what, argument in _WITHOUT:
            if isinstance(node, cls) and all(any(_named(n, name) for name in names) for n in own) \
                    and all(any(_named(n, name) for n in own) for name in names):
                kind = type(node).__name__
                return WITHOUT_HINT.format(tensors=", ".join(tensors), layer=_shown(layer), unsure=unsure,
                                           kind=kind, them="them" if len(tensors) > 1 else "it", what=f"torch's {what}",
                                           right=f"ft.nn.{kind}(..., {argument})")
    return ""


def _prefix_hint(report: FlatDictReport) -> str:
    """:data:`PREFIX_HINT` where every unexpected name is a missing one under one prefix
    (DataParallel's ``module.``, ``torch.compile``'s ``_orig_mod.``)."""
    missing = set(report.missing)
    if not report.unexpected or not missing:
        return ""
    first = report.unexpected[0]
    for prefix in [first[:i + 1] for i, c in enumerate(first) if c == "."]:
        if all(n.startswith(prefix) and n[len(prefix):] in missing for n in report.unexpected):
            why = {"module.": "torch's DataParallel / DistributedDataParallel",
                   "_orig_mod.": "a torch.compile'd module"}.get(prefix, "a wrapper module's name")
            return PREFIX_HINT.format(prefix=prefix, why=why, stripped=prefix[:-1])
    return ""


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
              and len(_shape(want)) == 2 and _shape(given) == _shape(want)[::-1] != _shape(want)]
    patterns = list(dict.fromkeys(".".join("*" if p.isdigit() else p for p in layer.split(".")) for layer in layers))
    if not patterns:
        return ""
    return DENSE_LAYOUTS_HINT.format(layers=", ".join(patterns) if any(patterns) else "the model",
                                     layouts={pattern: "conv1d" for pattern in patterns})


SHAPE_HINT = """
The state dict's tensors of {layers} are of other sizes than the model's: torch's layer has other \
features (or another kernel) there. To load its tensors, build the layer with torch's sizes; \
to train a new layer in its place (a 1000-class head replaced by one of 10 classes), load the \
rest with strict=False, which keeps the model's own as built (the report lists it):

{rights}
       or:  model, report = ft.nn.load_torch_state_dict(model, sd, strict=False)   # keeps {kept} as built"""

# SHAPE_HINT's {rights}: one per layer.
SHAPE_RIGHT = "    right:  {call}   # {layer} with torch's sizes"
# ... one per layer of a Stack's members (all of them given one other size): built by the Stack, never alone.
STACK_SHAPE_RIGHT = "    right:  {call}   # {layer} with torch's sizes (stacked leaf {leaf})"
# ... where only some members' differ: torch's members are of two sizes, and a Stack's are of one.
STACK_UNEVEN_RIGHT = """\
    right:  ft.nn.Sequential(...)   # {stack}'s members {members} are of other sizes than its \
others ({layer}{call}), and a Stack's members share one size (stacked leaf {leaf}): hold them \
apart, one layer each (a Sequential's members are torch's names alike)"""


def _built(node: Any, weight: tuple[int, ...]) -> str | None:
    """The constructor of ``node``'s class with the sizes of torch's ``weight`` (None for a
    layer whose sizes no single weight tells)."""
    cls = f"ft.nn.{type(node).__name__}"
    if isinstance(node, Dense) and len(weight) == 2:  # torch's [out, in]
        return f"{cls}({weight[1]}, {weight[0]}, ...)"
    if isinstance(node, Conv) and len(weight) >= 3:
        kernel = weight[2:] if len(set(weight[2:])) > 1 else weight[2]
        groups = f", groups={node.groups}" if node.groups != 1 else ""
        if isinstance(node, ConvTranspose):  # torch's [in, out // groups, *k]
            return f"{cls}({weight[0]}, {weight[1] * node.groups}, {kernel}{groups}, ...)"
        return f"{cls}({weight[1] * node.groups}, {weight[0]}, {kernel}{groups}, ...)"  # [out, in // groups, *k]
    if isinstance(node, Embedding) and len(weight) == 2:
        return f"{cls}({weight[0]}, {weight[1]}, ...)"
    if isinstance(node, (BatchNorm, _InstanceNorm, GroupNorm)) and len(weight) == 1:
        return f"{cls}({weight[0]}, ...)" if not isinstance(node, GroupNorm) else f"{cls}({node.groups}, {weight[0]}, ...)"
    return None


def _shape_hint(layers: Mapping[str, Any], report: FlatDictReport,
                stacks: Mapping[str, tuple[str, int, str]]) -> str:
    """:data:`SHAPE_HINT` for the known layers (``layers``: torch name -> layer) whose
    ``weight`` is given in another shape (a Dense's reversed one is :func:`_dense_layouts_hint`'s);
    a Stack member's (``stacks``: :func:`~functree.interop._torch._stacked_names`) by its Stack."""
    rights: list[str] = []
    shown: list[str] = []
    grouped: dict[tuple[str, str], list[tuple[str, str, int, str]]] = {}  # (stack, layer in a member) -> members
    for name, want, given in report.mismatched:
        layer, _, leaf = name.rpartition(".")
        node = layers.get(layer)
        shape, expected = _shape(given), _shape(want)
        if (leaf != "weight" or node is None or not shape or shape == expected  # of the same size: a dtype refused
                or (shape == expected[::-1] and isinstance(node, Dense))):
            continue
        call = _built(node, shape)
        if call is not None and name in stacks:
            stack, n, stored = stacks[name]
            member, _, inner = name[len(stack) + 1 if stack else 0:].partition(".")
            grouped.setdefault((stack, inner.rpartition(".")[0]), []).append((member, call, n, stored))
        elif call is not None:
            rights.append(SHAPE_RIGHT.format(call=call, layer=repr(layer) if layer else "the model"))
            shown.append(repr(layer) if layer else "the model")
    for (stack, inner), members in grouped.items():
        rights.append(_stack_right(stack, inner, members))
        shown.append(repr(stack) if stack else "the model")
    if not rights:
        return ""
    return SHAPE_HINT.format(layers=", ".join(shown[:4]) + (" ..." if len(shown) > 4 else ""),
                             rights="\n".join(rights[:4]), kept=", ".join(shown[:4]))


def _stack_right(stack: str, inner: str, members: list[tuple[str, str, int, str]]) -> str:
    """A Stack's right line: every member's layer ``inner`` given one other size (built by the
    Stack, :data:`STACK_SHAPE_RIGHT`) or some (:data:`STACK_UNEVEN_RIGHT`)."""
    _, call, n, leaf = members[0]
    named = repr(stack) if stack else "the model"
    if len(members) == n and len({c for _, c, _, _ in members}) == 1:
        built = call if inner else f"ft.nn.Stack(lambda k: {call}, {n}, ...)"
        layer = f"{inner!r} in each of {named}'s {n} members" if inner else f"{named}'s {n} members"
        return STACK_SHAPE_RIGHT.format(call=built, layer=layer, leaf=leaf)
    return STACK_UNEVEN_RIGHT.format(stack=named, members=[m for m, _, _, _ in members],
                                     layer=f"{inner!r}: " if inner else "", call=call, leaf=leaf)


def mismatch_error(rules: Sequence[Any], attentions: Sequence[str], report: FlatDictReport, hint: str = "",
                   layers: Mapping[str, Any] | None = None,
                   stacks: Mapping[str, tuple[str, int, str]] | None = None) -> ValueError:
    """:data:`TORCH_MISMATCH` for ``report``: an example of the rules' names (each with ``ft``
    and ``torch`` names: ``key path -> torch name``), the attentions' and Dense layers'
    ``layouts=`` hints, an RNN's direction, an option a known layer (``layers``: torch name ->
    layer) was built without, a wrapper's prefix, and ``hint`` (the ports')."""
    example = next((f"{r.ft[0]} -> {r.torch[0]}" for r in rules if "layers" in r.ft[0]), None) or next(
        (f"{r.ft[0]} -> {r.torch[0]}" if r.ft[0] != r.torch[0] else r.torch[0] for r in rules[:1]), "")
    names = TORCH_NAMES.format(example=example) if rules else ""
    return ValueError(TORCH_MISMATCH.format(report=report, names=names,
                                            hint=_layouts_hint(attentions, report) + _dense_layouts_hint(rules, attentions, report)
                                            + _rnn_direction_hint(report) + _statistics_hint(report)
                                            + _options_hint(layers or {}, report) + _without_hint(layers or {}, rules, report)
                                            + _shape_hint(layers or {}, report, stacks or {}) + _prefix_hint(report) + hint))
